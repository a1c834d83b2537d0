# The Forge pods' Google identity, with no key file: the RayService's pods run as the Kubernetes
# service account var.kubernetes_service_account, which GKE's metadata server (GKE_METADATA on
# every node pool) exchanges for this Google service account's tokens. configs/gke.yaml's
# fallback (auth: gcp_metadata) calls Vertex AI's Gemini with them.
resource "google_service_account" "forge" {
  account_id   = "${var.cluster_name}-pods"
  display_name = "Forge pods (RayService: gateways, vLLM workers)"
  description  = "Used through GKE workload identity only; it has no keys."
}

resource "google_service_account_iam_member" "forge_workload_identity" {
  service_account_id = google_service_account.forge.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${module.gke.workload_pool}[${var.kubernetes_namespace}/${var.kubernetes_service_account}]"
}

# Gemini on Vertex AI, keyless. aiplatform.user is the narrowest predefined role with
# aiplatform.endpoints.predict on publisher models.
resource "google_project_iam_member" "forge_vertex_ai" {
  project = var.project_id
  role    = "roles/aiplatform.user"
  member  = "serviceAccount:${google_service_account.forge.email}"
}
