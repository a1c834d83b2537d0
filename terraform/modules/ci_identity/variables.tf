variable "project_id" {
  description = "Project of the workload identity pool and the CI service account."
  type        = string
}

variable "github_repository" {
  description = "\"owner/name\" of the only GitHub repository whose workflows may authenticate."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9-]+/[A-Za-z0-9._-]+$", var.github_repository))
    error_message = "github_repository must be \"owner/name\"."
  }
}

variable "allowed_ref" {
  description = "The Git ref (refs/heads/main) whose runs may authenticate."
  type        = string
  default     = "refs/heads/main"
}

variable "pool_id" {
  description = "ID of the workload identity pool. A deleted pool keeps its ID for 30 days: pick another to recreate sooner."
  type        = string
  default     = "github"

  validation {
    condition     = can(regex("^[a-z0-9-]{4,32}$", var.pool_id)) && !startswith(var.pool_id, "gcp-")
    error_message = "pool_id must be 4-32 lowercase letters, digits or hyphens, not starting with gcp-."
  }
}

variable "artifact_location" {
  description = "Region of the Artifact Registry repository CI pushes to."
  type        = string
}

variable "artifact_repository_id" {
  description = "Artifact Registry repository CI pushes to."
  type        = string
}
