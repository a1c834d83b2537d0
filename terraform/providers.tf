provider "google" {
  project = var.project_id
  region  = var.region

  # Every resource that takes labels carries these, so the bill can be split by app.
  default_labels = {
    app        = "forge"
    managed-by = "terraform"
  }
}
