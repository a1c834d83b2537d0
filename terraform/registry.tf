# The images: Ray/gateway and the vLLM GPU worker. Tags are immutable, so the tag ArgoCD was
# told to deploy (a commit SHA) always names the same bytes.
resource "google_artifact_registry_repository" "images" {
  #checkov:skip=CKV_GCP_84:Google-managed encryption: a CMEK would add a KMS key ring, a key, its IAM and rotation for two public-source images with no secrets inside.
  repository_id = var.artifact_repository_id
  location      = var.region
  format        = "DOCKER"
  description   = "Forge images (Ray/gateway, vLLM worker), pushed by CI only."

  docker_config {
    immutable_tags = true
  }

  # Untagged layers left behind by rebuilds go after a week; tagged images stay.
  cleanup_policies {
    id     = "delete-untagged"
    action = "DELETE"

    condition {
      tag_state  = "UNTAGGED"
      older_than = "604800s"
    }
  }

  depends_on = [google_project_service.apis]
}

# The nodes pull the images with their own service account.
resource "google_artifact_registry_repository_iam_member" "nodes_pull" {
  project    = google_artifact_registry_repository.images.project
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${module.gke.node_service_account_email}"
}
