output "name" {
  description = "Cluster name."
  value       = google_container_cluster.this.name
}

output "location" {
  description = "Cluster location (zone or region)."
  value       = google_container_cluster.this.location
}

output "workload_pool" {
  description = "Workload identity pool of the cluster: <project>.svc.id.goog."
  value       = google_container_cluster.this.workload_identity_config[0].workload_pool
}

output "node_service_account_email" {
  description = "Service account of every node (logs, metrics, image pulls); never the pods'."
  value       = google_service_account.nodes.email
}

output "dns_endpoint" {
  description = "The control plane's DNS endpoint (IAM-checked)."
  value       = try(google_container_cluster.this.control_plane_endpoints_config[0].dns_endpoint_config[0].endpoint, null)
}

output "gpu_node_pool" {
  description = "What pods must select and tolerate to run on the spot T4 pool."
  value = {
    name          = google_container_node_pool.gpu.name
    node_selector = local.gpu_labels
    taint         = local.gpu_taint
  }
}

output "cpu_node_pool" {
  description = "What pods must select to run on the CPU pool."
  value = {
    name          = google_container_node_pool.cpu.name
    node_selector = local.cpu_labels
  }
}
