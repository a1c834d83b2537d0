# Forge on GKE: the network, the cluster and its two spot pools, Memorystore, Artifact Registry,
# Secret Manager, and the identities (the Forge pods' and CI's), none of them with a key file.

locals {
  cluster_location = var.regional_cluster ? var.region : var.zone
  labels = {
    cluster = var.cluster_name
  }
}

# The APIs the stack uses. Kept enabled on destroy: other things in the project may use them.
resource "google_project_service" "apis" {
  for_each = toset([
    "aiplatform.googleapis.com",
    "artifactregistry.googleapis.com",
    "cloudresourcemanager.googleapis.com",
    "compute.googleapis.com",
    "container.googleapis.com",
    "iam.googleapis.com",
    "iamcredentials.googleapis.com",
    "redis.googleapis.com",
    "sqladmin.googleapis.com",
    "secretmanager.googleapis.com",
    "servicenetworking.googleapis.com",
    "storage.googleapis.com",
    "sts.googleapis.com",
  ])

  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}

module "gke" {
  source = "./modules/gke"

  project_id          = var.project_id
  name                = var.cluster_name
  location            = local.cluster_location
  network             = google_compute_network.forge.id
  subnetwork          = google_compute_subnetwork.nodes.id
  pods_range_name     = local.pods_range_name
  services_range_name = local.services_range_name
  labels              = local.labels
  deletion_protection = var.deletion_protection

  master_ipv4_cidr_block     = var.master_ipv4_cidr_block
  enable_private_endpoint    = var.enable_private_endpoint
  enable_dns_endpoint        = var.enable_dns_endpoint
  master_authorized_networks = var.master_authorized_networks
  release_channel            = var.release_channel

  cpu_machine_type = var.cpu_machine_type
  cpu_spot         = var.cpu_spot
  cpu_min_nodes    = var.cpu_min_nodes
  cpu_max_nodes    = var.cpu_max_nodes
  cpu_node_zones   = var.cpu_node_zones

  gpu_machine_type   = var.gpu_machine_type
  gpu_max_nodes      = var.gpu_max_nodes
  gpu_node_zones     = var.gpu_node_zones
  gpu_driver_version = var.gpu_driver_version

  depends_on = [google_project_service.apis, google_compute_router_nat.nat]
}

module "ci_identity" {
  source = "./modules/ci_identity"

  project_id             = var.project_id
  github_repository      = var.github_repository
  allowed_ref            = var.github_ci_ref
  artifact_location      = google_artifact_registry_repository.images.location
  artifact_repository_id = google_artifact_registry_repository.images.repository_id

  depends_on = [google_project_service.apis]
}
