variable "project_id" {
  description = "Project of the cluster; its workload identity pool is <project_id>.svc.id.goog."
  type        = string
}

variable "name" {
  description = "Cluster name; also prefixes the node pools' service account."
  type        = string
}

variable "location" {
  description = "A zone (zonal cluster) or a region (regional cluster)."
  type        = string
}

variable "network" {
  description = "ID of the VPC network."
  type        = string
}

variable "subnetwork" {
  description = "ID of the nodes' subnetwork."
  type        = string
}

variable "pods_range_name" {
  description = "Name of the subnetwork's secondary range for Pods."
  type        = string
}

variable "services_range_name" {
  description = "Name of the subnetwork's secondary range for Services."
  type        = string
}

variable "labels" {
  description = "Resource labels of the cluster and its nodes."
  type        = map(string)
  default     = {}
}

variable "deletion_protection" {
  description = "Refuse terraform destroy of the cluster while true."
  type        = bool
  default     = true
}

variable "master_ipv4_cidr_block" {
  description = "The /28 of the private control plane."
  type        = string
}

variable "enable_private_endpoint" {
  description = "No public IP endpoint on the control plane."
  type        = bool
  default     = true
}

variable "enable_dns_endpoint" {
  description = "Allow IAM-checked access to the control plane's DNS endpoint from outside the VPC."
  type        = bool
  default     = true
}

variable "master_authorized_networks" {
  description = "CIDR blocks allowed to reach the control plane's IP endpoints."
  type = list(object({
    cidr_block   = string
    display_name = string
  }))
  default = []
}

variable "release_channel" {
  description = "GKE release channel."
  type        = string
  default     = "REGULAR"
}

variable "cpu_machine_type" {
  description = "Machine type of the CPU pool."
  type        = string
}

variable "cpu_spot" {
  description = "Whether the CPU pool (Ray head, gateways) is spot. Off: their drain outlasts a spot notice."
  type        = bool
  default     = false
}

variable "cpu_min_nodes" {
  description = "Fewest CPU nodes (per zone)."
  type        = number
}

variable "cpu_max_nodes" {
  description = "Most CPU nodes (per zone)."
  type        = number
}

variable "cpu_node_zones" {
  description = "Zones of the CPU nodes; empty for the cluster's default."
  type        = list(string)
  default     = []
}

variable "gpu_machine_type" {
  description = "N1 machine type of the spot T4 pool."
  type        = string
}

variable "gpu_max_nodes" {
  description = "Most T4 nodes in all of gpu_node_zones together (total_max_node_count); the pool's minimum is always 0."
  type        = number

  validation {
    condition     = var.gpu_max_nodes >= 1
    error_message = "gpu_max_nodes must be at least 1."
  }
}

variable "gpu_node_zones" {
  description = "Zones the T4 nodes may start in; empty for the cluster's default."
  type        = list(string)
  default     = []
}

variable "gpu_driver_version" {
  description = "GKE-installed NVIDIA driver: DEFAULT or LATEST (the root module's default, LATEST, is paired with the GPU image's CUDA in images/cuda-drivers.yaml)."
  type        = string
  default     = "LATEST"
}
