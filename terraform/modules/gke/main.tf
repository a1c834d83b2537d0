# A private GKE Standard cluster with workload identity and two node pools:
#   cpu: the Ray head, the gateway workers and the cluster's own services (KubeRay, ArgoCD,
#        Prometheus), always at least one node; on-demand unless cpu_spot (see its variable);
#   gpu: one NVIDIA T4 per node for the vLLM workers, autoscaled from 0 by the cluster
#        autoscaler when KubeRay adds a GPU worker Pod, and back to 0 when none is left.

locals {
  # Kubernetes spellings, for the chart's nodeSelector and tolerations (outputs.tf).
  cpu_labels = {
    "forge.dev/pool" = "cpu"
  }
  gpu_labels = {
    "forge.dev/pool"        = "gpu"
    "forge.dev/accelerator" = "nvidia-tesla-t4"
  }
  gpu_taint = {
    key    = "nvidia.com/gpu"
    value  = "present"
    effect = "NoSchedule"
  }
}

# The nodes' own identity: logs, metrics and image pulls, nothing else. Pods never use it: with
# GKE_METADATA they see their Kubernetes service account's workload identity instead.
resource "google_service_account" "nodes" {
  account_id   = "${var.name}-nodes"
  display_name = "GKE nodes of ${var.name}"
  description  = "Node VMs only (logging, monitoring, image pulls); no keys."
}

resource "google_project_iam_member" "nodes" {
  project = var.project_id
  role    = "roles/container.defaultNodeServiceAccount"
  member  = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_container_cluster" "this" {
  #checkov:skip=CKV_GCP_66:Binary Authorization needs an attestor pipeline that does not exist yet; images come only from the immutable-tag registry CI pushes to, named by commit in git.
  #checkov:skip=CKV_GCP_69:The cluster has no node_config of its own (its default pool is removed at creation); both node pools set GKE_METADATA, which CKV_GCP_69 checks on each pool.
  #checkov:skip=CKV_GCP_65:RBAC through Google Groups needs a Workspace/Cloud Identity domain; access is granted with IAM roles on the project instead.
  name     = var.name
  location = var.location

  # Node pools are managed below; the default pool is created (GKE requires one) then removed.
  remove_default_node_pool = true
  initial_node_count       = 1
  deletion_protection      = var.deletion_protection

  network           = var.network
  subnetwork        = var.subnetwork
  networking_mode   = "VPC_NATIVE"
  datapath_provider = "ADVANCED_DATAPATH"

  # NetworkPolicy (the chart's) is enforced by Dataplane V2 itself; the Calico add-on this block
  # turns on cannot run beside it, so it stays off.
  network_policy {
    enabled = false
  }

  ip_allocation_policy {
    cluster_secondary_range_name  = var.pods_range_name
    services_secondary_range_name = var.services_range_name
  }

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = var.enable_private_endpoint
    master_ipv4_cidr_block  = var.master_ipv4_cidr_block
  }

  control_plane_endpoints_config {
    dns_endpoint_config {
      allow_external_traffic = var.enable_dns_endpoint
    }
  }

  master_authorized_networks_config {
    gcp_public_cidrs_access_enabled = false

    dynamic "cidr_blocks" {
      for_each = var.master_authorized_networks
      content {
        cidr_block   = cidr_blocks.value.cidr_block
        display_name = cidr_blocks.value.display_name
      }
    }
  }

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  workload_identity_config {
    workload_pool = "${var.project_id}.svc.id.goog"
  }

  # No Secret Manager CSI add-on: the chart reads Kubernetes Secrets, copied from Secret Manager
  # or synced by External Secrets (docs/deploy.md), and an unused driver on every node is
  # surface with no use. Turn it on together with a SecretProviderClass in the chart.
  secret_manager_config {
    enabled = false
  }

  release_channel {
    channel = var.release_channel
  }

  enable_shielded_nodes       = true
  enable_legacy_abac          = false
  enable_intranode_visibility = true

  addons_config {
    http_load_balancing {
      disabled = false
    }
    gce_persistent_disk_csi_driver_config {
      enabled = true
    }
    # Model weights can be read from a GCS bucket instead of Hugging Face through the NAT.
    gcs_fuse_csi_driver_config {
      enabled = true
    }
  }

  # The pools' own autoscaling, no node auto-provisioning; idle nodes go sooner than with the
  # balanced profile: the GPU pool's cost is its idle time.
  cluster_autoscaling {
    enabled             = false
    autoscaling_profile = "OPTIMIZE_UTILIZATION"
  }

  logging_config {
    enable_components = ["SYSTEM_COMPONENTS", "WORKLOADS"]
  }

  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]
    # kube-prometheus-stack (cluster/) scrapes Ray and Forge; Google's managed collection would
    # scrape and bill the same series twice.
    managed_prometheus {
      enabled = false
    }
  }

  # GKE cost allocation: the bill split by namespace and label (docs/deploy.md, cost).
  cost_management_config {
    enabled = true
  }

  resource_labels = var.labels

  lifecycle {
    # The default pool's count is gone after creation; do not plan to recreate it.
    ignore_changes = [initial_node_count]
  }
}

resource "google_container_node_pool" "cpu" {
  name           = "cpu"
  cluster        = google_container_cluster.this.id
  location       = var.location
  node_locations = length(var.cpu_node_zones) > 0 ? var.cpu_node_zones : null

  initial_node_count = var.cpu_min_nodes

  autoscaling {
    min_node_count = var.cpu_min_nodes
    max_node_count = var.cpu_max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    # On-demand by default: the gateways' drain (streams up to request_timeout_s; Serve holds a
    # stopping direct-ingress replica >= 35 s) and the Ray head (its loss is the cluster's) do
    # not fit a spot node's 30 s notice. cpu_spot trades that for 60-90 % off.
    spot            = var.cpu_spot
    machine_type    = var.cpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = 50
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = local.cpu_labels
    resource_labels = var.labels

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }

  lifecycle {
    ignore_changes = [initial_node_count]
  }
}

resource "google_container_node_pool" "gpu" {
  name           = "gpu-t4-spot"
  cluster        = google_container_cluster.this.id
  location       = var.location
  node_locations = length(var.gpu_node_zones) > 0 ? var.gpu_node_zones : null

  # Zero until KubeRay asks for a GPU worker: the T4 costs nothing while the fallback serves.
  initial_node_count = 0

  # Totals across the pool's zones (not per zone): spot T4 capacity is taken in whichever zone
  # of gpu_node_zones has it, and gpu_max_nodes stays the cap on T4s (and on the quota asked),
  # however many zones are listed.
  autoscaling {
    total_min_node_count = 0
    total_max_node_count = var.gpu_max_nodes
    location_policy      = "ANY"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  # Upgrade by replacing nodes one at a time, never by surging: a surge node is a second T4 the
  # quota (often 1) may not have, which would stall the upgrade.
  upgrade_settings {
    strategy        = "SURGE"
    max_surge       = 0
    max_unavailable = 1
  }

  node_config {
    spot            = true
    machine_type    = var.gpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = 100 # CUDA + vLLM image and the model's weights
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = local.gpu_labels
    resource_labels = var.labels

    guest_accelerator {
      type  = "nvidia-tesla-t4"
      count = 1

      # GKE installs the driver itself (no DaemonSet to manage): LATEST by default, a driver
      # branch that runs the image's CUDA 12.9 vLLM (images/cuda-drivers.yaml).
      gpu_driver_installation_config {
        gpu_driver_version = var.gpu_driver_version
      }
    }

    # Only Pods that tolerate the GPU keep the node busy, so it can scale back to zero.
    taint {
      key    = "nvidia.com/gpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    # Image streaming: the multi-GB vLLM image starts before it is fully pulled, which shortens
    # the scale-from-zero wait.
    gcfs_config {
      enabled = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }

  lifecycle {
    ignore_changes = [initial_node_count]
  }
}
