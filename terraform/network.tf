# A custom VPC: one subnet for the nodes with secondary ranges for Pods and Services
# (VPC-native), Cloud NAT for the private nodes' egress (Hugging Face, PyPI, GitHub), Private
# Google Access so Google APIs (Artifact Registry pulls, GCS, Vertex AI, Secret Manager) bypass
# the NAT and its per-GB charge, and private service access for Memorystore.

locals {
  pods_range_name     = "pods"
  services_range_name = "services"
}

resource "google_compute_network" "forge" {
  name                    = "${var.cluster_name}-vpc"
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"

  depends_on = [google_project_service.apis]
}

resource "google_compute_subnetwork" "nodes" {
  name                     = "${var.cluster_name}-nodes"
  region                   = var.region
  network                  = google_compute_network.forge.id
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true

  secondary_ip_range {
    range_name    = local.pods_range_name
    ip_cidr_range = var.pods_cidr
  }

  secondary_ip_range {
    range_name    = local.services_range_name
    ip_cidr_range = var.services_cidr
  }

  # Flow logs for incident forensics, sampled and aggregated so their log volume stays cheap.
  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.1
    metadata             = "EXCLUDE_ALL_METADATA"
  }
}

resource "google_compute_router" "nat" {
  name    = "${var.cluster_name}-router"
  region  = var.region
  network = google_compute_network.forge.id
}

resource "google_compute_router_nat" "nat" {
  name                               = "${var.cluster_name}-nat"
  router                             = google_compute_router.nat.name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

# Private service access: a range of this VPC peered to Google's service producers.
resource "google_compute_global_address" "services" {
  name          = "${var.cluster_name}-services"
  purpose       = "VPC_PEERING"
  address_type  = "INTERNAL"
  prefix_length = var.services_peering_prefix_length
  network       = google_compute_network.forge.id
}

resource "google_service_networking_connection" "services" {
  network                 = google_compute_network.forge.id
  service                 = "servicenetworking.googleapis.com"
  reserved_peering_ranges = [google_compute_global_address.services.name]
}

# GKE adds its own allow rules (control plane to nodes, node to node, load balancer health
# checks). Everything else inbound is denied, explicitly and with logs, just above the implied
# rule, so a probe of the nodes shows up in Cloud Logging.
resource "google_compute_firewall" "deny_ingress" {
  name      = "${var.cluster_name}-deny-ingress"
  network   = google_compute_network.forge.id
  direction = "INGRESS"
  priority  = 65534

  source_ranges = ["0.0.0.0/0"]

  deny {
    protocol = "all"
  }

  log_config {
    metadata = "EXCLUDE_ALL_METADATA"
  }
}
