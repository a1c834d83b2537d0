# The models' weights, in a bucket of the project: the GPU workers mount it read-only through
# GKE's Cloud Storage FUSE CSI driver (the add-on modules/gke enables) and vLLM loads the model
# from that path (configs/gke.yaml: the pools' engine.model, under the chart's
# modelWeights.mountPath). A cold start then reads ~6.6 GB from GCS in the region, through
# Private Google Access (no NAT bytes, no Hugging Face rate limits) instead of downloading it.
# docs/deploy.md copies the weights in once; the Hugging Face token is the documented
# alternative for pools that keep a Hugging Face id.
resource "google_storage_bucket" "weights" {
  #checkov:skip=CKV_GCP_62:Access logs would need a second bucket for a bucket that only the pods' own service account reads; Cloud Audit Logs' data-access logs can be turned on for it instead.
  name     = "${var.project_id}-${var.cluster_name}-weights"
  location = var.region
  labels   = local.labels

  # Regional, beside the nodes: reads cost no inter-region egress.
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = false

  # A weights revision is written once under its own path; versioning keeps an overwritten or
  # deleted object recoverable, and the old versions go after a month.
  versioning {
    enabled = true
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = 30
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  depends_on = [google_project_service.apis]
}

# The Forge pods' Google service account (workload_identity.tf) reads the weights, and nothing
# writes them but an operator (docs/deploy.md). The FUSE driver mounts with the pod's own
# workload identity, so this is the binding the GPU workers use.
resource "google_storage_bucket_iam_member" "forge_reads_weights" {
  bucket = google_storage_bucket.weights.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.forge.email}"
}
