# Inputs of the Forge stack. Only project_id and github_repository have no default; the rest
# encode the choices explained in README.md (zonal cluster, spot pools, private endpoint).

variable "project_id" {
  description = "The GCP project that holds everything (an existing project with billing on)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a GCP project ID: 6-30 characters, lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen."
  }
}

variable "region" {
  description = "Region of the network, Memorystore, Artifact Registry and Vertex AI calls. It must offer T4 GPUs (us-central1 does, in zones a, b, c and f)."
  type        = string
  default     = "us-central1"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+$", var.region))
    error_message = "region must be a GCP region such as us-central1 or europe-west4 (not a zone)."
  }
}

variable "zone" {
  description = "Zone of the zonal cluster's control plane and default zone of its nodes and of Memorystore. It must be in var.region and offer T4 GPUs."
  type        = string
  default     = "us-central1-a"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone)) && startswith(var.zone, "${var.region}-")
    error_message = "zone must be a zone of var.region, such as us-central1-a."
  }
}

variable "regional_cluster" {
  description = "Run a regional control plane (three zones, $0.10/h, outside the GKE free tier) instead of a zonal one (free tier). See README.md, \"Zonal, not regional\"."
  type        = bool
  default     = false
}

variable "cluster_name" {
  description = "Name of the GKE cluster; it also prefixes the network, router and node service account."
  type        = string
  default     = "forge"

  validation {
    condition     = can(regex("^[a-z]([a-z0-9-]{0,18}[a-z0-9])?$", var.cluster_name))
    error_message = "cluster_name must be 1-20 characters: lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "deletion_protection" {
  description = "Refuse to destroy the cluster until this is set to false and applied (teardown in README.md)."
  type        = bool
  default     = true
}

# --- Network ---------------------------------------------------------------------------------

variable "subnet_cidr" {
  description = "Primary range of the cluster subnet (node IPs)."
  type        = string
  default     = "10.10.0.0/20"

  validation {
    condition     = can(cidrnetmask(var.subnet_cidr))
    error_message = "subnet_cidr must be an IPv4 CIDR block such as 10.10.0.0/20."
  }
}

variable "pods_cidr" {
  description = "Secondary range for Pod IPs (VPC-native cluster)."
  type        = string
  default     = "10.20.0.0/16"

  validation {
    condition     = can(cidrnetmask(var.pods_cidr))
    error_message = "pods_cidr must be an IPv4 CIDR block such as 10.20.0.0/16."
  }
}

variable "services_cidr" {
  description = "Secondary range for Service ClusterIPs."
  type        = string
  default     = "10.30.0.0/20"

  validation {
    condition     = can(cidrnetmask(var.services_cidr))
    error_message = "services_cidr must be an IPv4 CIDR block such as 10.30.0.0/20."
  }
}

variable "master_ipv4_cidr_block" {
  description = "The /28 the private control plane's endpoint lives in; it must not overlap the other ranges."
  type        = string
  default     = "172.16.0.0/28"

  validation {
    condition     = can(cidrnetmask(var.master_ipv4_cidr_block)) && endswith(var.master_ipv4_cidr_block, "/28")
    error_message = "master_ipv4_cidr_block must be an IPv4 /28 block such as 172.16.0.0/28."
  }
}

variable "services_peering_prefix_length" {
  description = "Size of the range reserved for private service access (Memorystore lives in it)."
  type        = number
  default     = 20

  validation {
    condition     = var.services_peering_prefix_length >= 16 && var.services_peering_prefix_length <= 24
    error_message = "services_peering_prefix_length must be between 16 and 24 (Memorystore needs at least a /29 per instance; Google recommends /16 to /24 for the whole peering)."
  }
}

# --- Control plane access --------------------------------------------------------------------

variable "enable_private_endpoint" {
  description = "Give the control plane no public IP endpoint. Operators then reach it through its DNS endpoint (IAM-checked) or from inside the VPC. See README.md, \"Control plane access\"."
  type        = bool
  default     = true
}

variable "enable_dns_endpoint" {
  description = "Let authorized principals reach the control plane through its DNS endpoint from outside the VPC (every call still needs IAM permission on the cluster)."
  type        = bool
  default     = true
}

variable "master_authorized_networks" {
  description = "CIDR blocks allowed to reach the control plane's IP endpoints (the private one, and the public one if enable_private_endpoint is false). Empty: only the cluster's own network."
  type = list(object({
    cidr_block   = string
    display_name = string
  }))
  default = []

  validation {
    condition     = alltrue([for n in var.master_authorized_networks : can(cidrnetmask(n.cidr_block))])
    error_message = "Every master_authorized_networks entry needs an IPv4 cidr_block such as 203.0.113.7/32."
  }

  validation {
    condition     = alltrue([for n in var.master_authorized_networks : n.cidr_block != "0.0.0.0/0"])
    error_message = "0.0.0.0/0 authorizes the whole internet; use the DNS endpoint or name your own ranges."
  }
}

variable "release_channel" {
  description = "GKE release channel: nodes and control plane upgrade themselves within it."
  type        = string
  default     = "REGULAR"

  validation {
    condition     = contains(["RAPID", "REGULAR", "STABLE"], var.release_channel)
    error_message = "release_channel must be RAPID, REGULAR or STABLE."
  }
}

# --- Node pools ------------------------------------------------------------------------------

variable "cpu_machine_type" {
  description = "Machine type of the CPU pool (Ray head, gateway workers, KubeRay, ArgoCD, Prometheus)."
  type        = string
  default     = "e2-standard-4"

  validation {
    condition     = can(regex("^[a-z0-9]+-[a-z0-9]+(-[0-9]+)?$", var.cpu_machine_type))
    error_message = "cpu_machine_type must be a machine type name such as e2-standard-4."
  }
}

variable "cpu_spot" {
  description = "Run the CPU pool (Ray head, gateways) on spot VMs: 60-90 % cheaper, but a gateway's drain (up to the pools' request_timeout_s; at least 35 s in HAProxy mode) and the head do not fit the 30 s preemption notice, so preemption cuts streams. Set the chart's head.spot and workers.cpu.spot to match."
  type        = bool
  default     = false
}

variable "cpu_min_nodes" {
  description = "Fewest nodes of the CPU pool (per zone in cpu_node_zones). The Ray head and the gateways live here, so at least 1."
  type        = number
  default     = 1

  validation {
    condition     = var.cpu_min_nodes >= 1 && floor(var.cpu_min_nodes) == var.cpu_min_nodes
    error_message = "cpu_min_nodes must be a whole number >= 1: the Ray head must have a node."
  }
}

variable "cpu_max_nodes" {
  description = "Most nodes of the CPU pool (per zone in cpu_node_zones). Each e2-standard-4 holds one Ray pod (head 2.5 CPU, gateway workers 2): 3 at steady state, 5 at the CPU group's maxReplicas, and a NewCluster upgrade brings up a second cluster (3 more) before deleting the old one."
  type        = number
  default     = 8

  validation {
    condition     = var.cpu_max_nodes >= var.cpu_min_nodes && floor(var.cpu_max_nodes) == var.cpu_max_nodes
    error_message = "cpu_max_nodes must be a whole number >= cpu_min_nodes."
  }
}

variable "cpu_node_zones" {
  description = "Zones of the CPU pool's nodes. Empty: the cluster's default (var.zone when zonal, every zone of the region when regional)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for z in var.cpu_node_zones : startswith(z, "${var.region}-")])
    error_message = "Every zone in cpu_node_zones must be in var.region."
  }
}

variable "gpu_machine_type" {
  description = "Machine type of the spot T4 pool: an N1 type (T4s attach to N1 only). n1-standard-8 fits the vLLM replica's 4 Ray CPUs next to the node's daemons and ~30 GB RAM for loading weights."
  type        = string
  default     = "n1-standard-8"

  validation {
    condition     = startswith(var.gpu_machine_type, "n1-")
    error_message = "gpu_machine_type must be an N1 machine type: T4 GPUs attach only to N1 VMs."
  }
}

variable "gpu_max_nodes" {
  description = "Most spot T4 nodes, in all of gpu_node_zones together (the pool's total_max_node_count). The pools scale from 0; this also bounds the spend. At least what the GPU pools can ask at once (configs/gke.yaml: primary 3 + embed 1); the project needs as much PREEMPTIBLE_NVIDIA_T4_GPUS quota."
  type        = number
  default     = 4

  validation {
    condition     = var.gpu_max_nodes >= 1 && var.gpu_max_nodes <= 16 && floor(var.gpu_max_nodes) == var.gpu_max_nodes
    error_message = "gpu_max_nodes must be a whole number from 1 to 16: 0 would leave the primary pool nowhere to run."
  }
}

variable "gpu_node_zones" {
  description = "Zones where spot T4 nodes may start (location_policy ANY: whichever has capacity). More zones find spot capacity more often, and a zone's preemption wave or stock-out does not take every T4; each must offer T4s. The default is us-central1's four T4 zones: set it with another region. Empty: the cluster's zone alone."
  type        = list(string)
  default     = ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"]

  validation {
    condition     = alltrue([for z in var.gpu_node_zones : startswith(z, "${var.region}-")])
    error_message = "Every zone in gpu_node_zones must be in var.region."
  }
}

variable "gpu_driver_version" {
  description = "NVIDIA driver GKE installs on the T4 nodes: LATEST (R570 or newer), or DEFAULT (the GKE version's default, which changes as the release channel moves the nodes). The GPU image's vLLM is the CUDA 12.9 build, which needs R525+ (images/cuda-drivers.yaml pairs the two; tests/deploy/test_terraform.py fails a setting whose lowest driver cannot run it)."
  type        = string
  default     = "LATEST"

  validation {
    condition     = contains(["DEFAULT", "LATEST"], var.gpu_driver_version)
    error_message = "gpu_driver_version must be DEFAULT or LATEST (INSTALLATION_DISABLED would need the driver DaemonSet by hand)."
  }
}

# --- Forge's workload identity ---------------------------------------------------------------

variable "kubernetes_namespace" {
  description = "Namespace of the RayService (helm/forge): its pods run as the Kubernetes service account below."
  type        = string
  default     = "forge"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.kubernetes_namespace))
    error_message = "kubernetes_namespace must be a DNS-1123 label."
  }
}

variable "kubernetes_service_account" {
  description = "Kubernetes service account of the Forge pods, bound to the Forge Google service account through workload identity."
  type        = string
  default     = "forge"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.kubernetes_service_account))
    error_message = "kubernetes_service_account must be a DNS-1123 label."
  }
}

# --- Redis -----------------------------------------------------------------------------------

# Tiers and eviction are not inputs: redis.tf says why budgets need STANDARD_HA and noeviction,
# and why the cache is BASIC with allkeys-lru.

variable "redis_memory_size_gb" {
  description = "Capacity of the budgets' Memorystore (STANDARD_HA, noeviction), in GB. It holds a few small keys per tenant, and one or two ids per settled request for an hour (about 150 bytes each): 1 GB is about a thousand requests a second. Full, it refuses writes and budgets fall back to each gateway's local share: alert on its memory usage."
  type        = number
  default     = 1

  validation {
    condition     = var.redis_memory_size_gb >= 1 && var.redis_memory_size_gb <= 300
    error_message = "redis_memory_size_gb must be from 1 to 300."
  }
}

variable "redis_cache_memory_size_gb" {
  description = "Capacity of the response cache's Memorystore (BASIC, allkeys-lru), in GB: full, it evicts its least recently used entries, so size it for the hit rate wanted, not for safety."
  type        = number
  default     = 1

  validation {
    condition     = var.redis_cache_memory_size_gb >= 1 && var.redis_cache_memory_size_gb <= 300
    error_message = "redis_cache_memory_size_gb must be from 1 to 300."
  }
}

variable "ray_gcs_redis_memory_size_gb" {
  description = "Capacity of Ray's GCS fault-tolerance Memorystore (STANDARD_HA, noeviction; ray_gcs.tf), in GB. It holds the GCS's tables (a few MB for this cluster's actors and nodes): the smallest size carries it."
  type        = number
  default     = 1

  validation {
    condition     = var.ray_gcs_redis_memory_size_gb >= 1 && var.ray_gcs_redis_memory_size_gb <= 300
    error_message = "ray_gcs_redis_memory_size_gb must be from 1 to 300."
  }
}

# --- Images and CI ---------------------------------------------------------------------------

variable "artifact_repository_id" {
  description = "Artifact Registry (docker) repository for the Ray/gateway and vLLM worker images."
  type        = string
  default     = "forge"

  validation {
    condition     = can(regex("^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$", var.artifact_repository_id))
    error_message = "artifact_repository_id must be lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "github_repository" {
  description = "The GitHub repository (\"owner/name\") whose Actions may push images, and only it."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}$", var.github_repository))
    error_message = "github_repository must be \"owner/name\", such as acme/forge."
  }
}

variable "github_ci_ref" {
  description = "The Git ref whose workflow runs may authenticate to GCP and push images (pull requests never push)."
  type        = string
  default     = "refs/heads/main"

  validation {
    condition     = can(regex("^refs/(heads|tags)/[A-Za-z0-9._/-]+$", var.github_ci_ref))
    error_message = "github_ci_ref must be a full ref such as refs/heads/main."
  }
}

variable "ledger_tier" {
  description = "Cloud SQL machine tier of the usage ledger (cloudsql.tf). The gateways write one small transaction per replica per second: the smallest shared-core tier carries it. An ENTERPRISE edition tier (shared-core or db-custom-*): cloudsql.tf names that edition, since ENTERPRISE_PLUS takes only db-perf-optimized-N-* tiers."
  type        = string
  default     = "db-g1-small"
}

variable "ledger_availability_type" {
  description = "ZONAL: one instance (an outage delays usage, the gateways keep it queued and retry). REGIONAL: a standby in another zone, failover in about a minute, at twice the price."
  type        = string
  default     = "ZONAL"

  validation {
    condition     = contains(["ZONAL", "REGIONAL"], var.ledger_availability_type)
    error_message = "ledger_availability_type must be ZONAL or REGIONAL."
  }
}
