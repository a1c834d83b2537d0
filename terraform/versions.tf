terraform {
  # 1.9: a variable's validation may name other variables (a zone must sit in var.region).
  required_version = ">= 1.9, < 2.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = "~> 6.30"
    }
    # The ledger database user's password (cloudsql.tf), kept in the state and Secret Manager.
    random = {
      source  = "hashicorp/random"
      version = "~> 3.6"
    }
  }

  # Remote state in GCS, locked by the bucket itself. A backend block takes no variables, so the
  # bucket is named at init, after it has been created once by hand (README.md, "Bootstrap"):
  #   terraform init -backend-config="bucket=<project id>-forge-tfstate"
  backend "gcs" {
    prefix = "forge/gke"
  }
}
