output "cluster_name" {
  description = "GKE cluster name."
  value       = module.gke.name
}

output "cluster_location" {
  description = "GKE cluster location (a zone unless regional_cluster)."
  value       = module.gke.location
}

output "get_credentials_command" {
  description = "kubectl access through the control plane's IAM-checked DNS endpoint."
  value       = "gcloud container clusters get-credentials ${module.gke.name} --location ${module.gke.location} --project ${var.project_id} --dns-endpoint"
}

output "artifact_registry" {
  description = "Image prefix for docker push/pull: <region>-docker.pkg.dev/<project>/<repository>."
  value       = "${google_artifact_registry_repository.images.location}-docker.pkg.dev/${var.project_id}/${google_artifact_registry_repository.images.repository_id}"
}

output "forge_service_account" {
  description = "Google service account of the Forge pods; annotate their Kubernetes service account with iam.gke.io/gcp-service-account set to this."
  value       = google_service_account.forge.email
}

output "kubernetes_service_account" {
  description = "Namespace and name of the Kubernetes service account the Forge pods must run as."
  value = {
    namespace = var.kubernetes_namespace
    name      = var.kubernetes_service_account
  }
}

output "secrets" {
  description = "Secret Manager secret IDs by role: what docs/deploy.md copies into the Kubernetes Secrets the chart reads."
  value       = { for k, s in google_secret_manager_secret.forge : k => s.secret_id }
}

output "redis_host" {
  description = "The budgets' Memorystore (STANDARD_HA): its private IP."
  value       = google_redis_instance.budgets.host
}

output "redis_port" {
  description = "The budgets' Memorystore: its TLS port."
  value       = google_redis_instance.budgets.port
}

output "redis_url" {
  description = "FORGE_REDIS_URL, the budgets' Memorystore (rediss://, with the AUTH string): also in the forge-redis-url secret, which is what the pods read."
  value       = local.redis_url
  sensitive   = true
}

output "redis_cache_host" {
  description = "The response cache's Memorystore (BASIC): its private IP."
  value       = google_redis_instance.cache.host
}

output "redis_cache_port" {
  description = "The response cache's Memorystore: its TLS port."
  value       = google_redis_instance.cache.port
}

output "redis_cache_url" {
  description = "FORGE_CACHE_REDIS_URL, the response cache's Memorystore (rediss://, with the AUTH string): also in the forge-redis-cache-url secret, which is what the pods read."
  value       = local.redis_cache_url
  sensitive   = true
}

output "vertex_ai_base_url" {
  description = "OpenAI-compatible Vertex AI endpoint of this project, for the fallback's base_url (configs/gke.yaml): the global one, which serves the Gemini 3 models configs/vertex-models.yaml lists (their regional endpoints do not)."
  value       = "https://aiplatform.googleapis.com/v1/projects/${var.project_id}/locations/global/endpoints/openapi"
}

output "gpu_node_pool" {
  description = "Node selector and taint of the spot T4 pool, for the chart's GPU worker group."
  value       = module.gke.gpu_node_pool
}

output "cpu_node_pool" {
  description = "Node selector of the CPU pool, for the chart's head and gateway groups."
  value       = module.gke.cpu_node_pool
}

output "ci_workload_identity_provider" {
  description = "GitHub Actions secret/variable for google-github-actions/auth: workload_identity_provider."
  value       = module.ci_identity.workload_identity_provider
}

output "ci_service_account" {
  description = "GitHub Actions secret/variable for google-github-actions/auth: service_account."
  value       = module.ci_identity.service_account_email
}

output "ledger_url" {
  description = "FORGE_LEDGER_URL (postgresql://, with the password): also in the forge-ledger-url secret, which is what the pods read."
  value       = local.ledger_url
  sensitive   = true
}

output "weights_bucket" {
  description = "The models' weights bucket (weights.tf): the chart's modelWeights.bucket, where docs/deploy.md copies each model once."
  value       = google_storage_bucket.weights.name
}

output "ray_gcs_redis_host" {
  description = "Ray's GCS fault-tolerance Memorystore (STANDARD_HA): its private IP. Its rediss:// address, AUTH string and CA are in the forge-ray-gcs-redis-* secrets, which docs/deploy.md copies into the forge-ray-gcs-redis Secret the chart reads."
  value       = google_redis_instance.ray_gcs.host
}
