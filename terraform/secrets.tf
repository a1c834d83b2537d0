# Secret Manager holds the values behind the Kubernetes Secrets the chart reads (the key hashes
# and CAs it mounts at /etc/forge/keys/, the URLs it exports): docs/deploy.md copies each into the
# release namespace (kubectl, or External Secrets), and no Secret Manager CSI driver or
# SecretProviderClass is involved (the GKE add-on stays off, modules/gke). Terraform creates the
# secrets, never a value from git: an operator adds the human-made versions (README.md,
# "Bootstrap"); the Redis URLs, addresses and CAs and the ledger's URL are written here and in
# ray_gcs.tf from the instances' own attributes.
locals {
  forge_secrets = {
    # Only if the fallback uses an API key (Gemini's OpenAI-compatible endpoint on AI Studio):
    # on Vertex AI (configs/gke.yaml, auth: gcp_metadata) the pods need no key at all.
    "gemini-api-key"         = "Gemini API key, for a fallback that uses one instead of Vertex AI's workload identity."
    "tenant-key-hashes"      = "Tenants' API key hashes, {tenant: [sha256 hex]} YAML (key-hashes.yaml)."
    "admin-key-hashes"       = "Operators' /admin key hashes (admin-key-hashes.yaml)."
    "redis-url"              = "FORGE_REDIS_URL: the budgets' Memorystore, with AUTH and TLS (written by Terraform)."
    "redis-ca"               = "The budgets' Memorystore's server CA certificate (PEM), for the TLS in redis-url (written by Terraform)."
    "redis-cache-url"        = "FORGE_CACHE_REDIS_URL: the response cache's Memorystore, with AUTH and TLS (written by Terraform)."
    "redis-cache-ca"         = "The response cache's Memorystore's server CA certificate (PEM), for the TLS in redis-cache-url (written by Terraform)."
    "ledger-url"             = "FORGE_LEDGER_URL: the usage ledger, Cloud SQL for PostgreSQL over private IP and TLS (written by Terraform)."
    "ray-gcs-redis-address"  = "Ray's GCS fault tolerance: its own Memorystore's rediss://host:port (ray_gcs.tf; written by Terraform)."
    "ray-gcs-redis-password" = "Ray's GCS fault tolerance: that Memorystore's AUTH string (written by Terraform)."
    "ray-gcs-redis-ca"       = "Ray's GCS fault tolerance: that Memorystore's server CA certificate (PEM; written by Terraform)."
  }
}

resource "google_secret_manager_secret" "forge" {
  for_each = local.forge_secrets

  secret_id = "forge-${each.key}"
  labels    = local.labels
  annotations = {
    description = each.value
  }

  replication {
    auto {}
  }

  depends_on = [google_project_service.apis]
}

# The Forge pods read them; nothing else in the cluster can.
resource "google_secret_manager_secret_iam_member" "forge_reads" {
  for_each = google_secret_manager_secret.forge

  secret_id = each.value.id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.forge.email}"
}

resource "google_secret_manager_secret_version" "redis_url" {
  secret      = google_secret_manager_secret.forge["redis-url"].id
  secret_data = local.redis_url
}

resource "google_secret_manager_secret_version" "ledger_url" {
  secret      = google_secret_manager_secret.forge["ledger-url"].id
  secret_data = local.ledger_url
}

resource "google_secret_manager_secret_version" "redis_ca" {
  secret      = google_secret_manager_secret.forge["redis-ca"].id
  secret_data = google_redis_instance.budgets.server_ca_certs[0].cert
}

resource "google_secret_manager_secret_version" "redis_cache_url" {
  secret      = google_secret_manager_secret.forge["redis-cache-url"].id
  secret_data = local.redis_cache_url
}

resource "google_secret_manager_secret_version" "redis_cache_ca" {
  secret      = google_secret_manager_secret.forge["redis-cache-ca"].id
  secret_data = google_redis_instance.cache.server_ca_certs[0].cert
}
