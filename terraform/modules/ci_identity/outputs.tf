output "workload_identity_provider" {
  description = "Full provider name, for google-github-actions/auth's workload_identity_provider."
  value       = google_iam_workload_identity_pool_provider.github.name
}

output "service_account_email" {
  description = "CI service account, for google-github-actions/auth's service_account."
  value       = google_service_account.ci.email
}
