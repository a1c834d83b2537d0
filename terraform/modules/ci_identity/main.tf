# Keyless CI: GitHub Actions' OIDC token is exchanged for a short-lived token of a CI service
# account (google-github-actions/auth with workload_identity_provider + service_account). No
# JSON key exists to leak: the trust is the token's signed claims, checked twice:
#   - the provider accepts only tokens whose subject is var.github_repository on var.allowed_ref;
#   - the service account lets only that repository's principalSet impersonate it.

resource "google_iam_workload_identity_pool" "github" {
  project                   = var.project_id
  workload_identity_pool_id = var.pool_id
  display_name              = "GitHub Actions"
  description               = "OIDC tokens of ${var.github_repository}'s workflows."
}

resource "google_iam_workload_identity_pool_provider" "github" {
  project                            = var.project_id
  workload_identity_pool_id          = google_iam_workload_identity_pool.github.workload_identity_pool_id
  workload_identity_pool_provider_id = "github-actions"
  display_name                       = "GitHub Actions OIDC"

  attribute_mapping = {
    "google.subject"       = "assertion.sub"
    "attribute.repository" = "assertion.repository"
    "attribute.ref"        = "assertion.ref"
    "attribute.actor"      = "assertion.actor"
  }

  # Without a condition, any GitHub repository's workflow could present a token to this pool.
  # The subject names the repository and the ref ("repo:acme/forge:ref:refs/heads/main"); a job
  # with an `environment:` gets "repo:acme/forge:environment:<name>" instead and is refused.
  attribute_condition = "assertion.sub == \"repo:${var.github_repository}:ref:${var.allowed_ref}\""

  oidc {
    issuer_uri = "https://token.actions.githubusercontent.com"
  }
}

resource "google_service_account" "ci" {
  project      = var.project_id
  account_id   = "forge-ci"
  display_name = "Forge CI (GitHub Actions, keyless)"
  description  = "Impersonated through workload identity federation by ${var.github_repository}; no keys."
}

resource "google_service_account_iam_member" "ci_impersonation" {
  service_account_id = google_service_account.ci.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "principalSet://iam.googleapis.com/${google_iam_workload_identity_pool.github.name}/attribute.repository/${var.github_repository}"
}

# Push (and overwrite nothing: the repository's tags are immutable) to the one repository.
resource "google_artifact_registry_repository_iam_member" "ci_push" {
  project    = var.project_id
  location   = var.artifact_location
  repository = var.artifact_repository_id
  role       = "roles/artifactregistry.writer"
  member     = "serviceAccount:${google_service_account.ci.email}"
}
