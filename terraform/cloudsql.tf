# Cloud SQL for PostgreSQL: the durable usage ledger (configs/gke.yaml: metering.database_url_env
# FORGE_LEDGER_URL). What tenants are billed from lives here, apart from the cache and the
# budgets in Memorystore: daily backups kept 30 days, point-in-time recovery over 7 days of
# transaction logs, deletion protection, private IP only, TLS required. The gateways write it
# off the request path, in batches, each applied once (serve_app/metering/postgres.py); while it
# is down they keep their usage queued and retry.
locals {
  ledger_url = format(
    "postgresql://%s:%s@%s:5432/%s?sslmode=require",
    google_sql_user.ledger.name,
    urlencode(random_password.ledger.result),
    google_sql_database_instance.ledger.private_ip_address,
    google_sql_database.ledger.name,
  )
}

resource "google_sql_database_instance" "ledger" {
  #checkov:skip=CKV_GCP_6:ssl_mode ENCRYPTED_ONLY refuses every unencrypted connection; the check wants client certificates too, a certificate per pod for an instance with no public IP.
  name             = "${var.cluster_name}-ledger"
  region           = var.region
  database_version = "POSTGRES_18"

  deletion_protection = true

  settings {
    # Named, not left to the API: for POSTGRES_16 and later its default edition is
    # ENTERPRISE_PLUS, which takes only db-perf-optimized-N-* tiers and refuses the shared-core
    # ledger_tier (db-g1-small) at apply ("Invalid Tier ... for (ENTERPRISE_PLUS) Edition").
    edition           = "ENTERPRISE"
    tier              = var.ledger_tier
    availability_type = var.ledger_availability_type
    disk_autoresize   = true
    user_labels       = local.labels

    backup_configuration {
      enabled                        = true
      start_time                     = "03:00"
      point_in_time_recovery_enabled = true
      transaction_log_retention_days = 7
      backup_retention_settings {
        retained_backups = 30
      }
    }

    ip_configuration {
      ipv4_enabled    = false
      private_network = google_compute_network.forge.id
      ssl_mode        = "ENCRYPTED_ONLY"
    }

    # Patches on Sunday 05:00 UTC, after Memorystore's window.
    maintenance_window {
      day  = 7
      hour = 5
    }

    # What CIS asks a PostgreSQL instance to log (checkov's CKV_GCP_51..57, 108..111).
    database_flags {
      name  = "log_checkpoints"
      value = "on"
    }
    database_flags {
      name  = "log_connections"
      value = "on"
    }
    database_flags {
      name  = "log_disconnections"
      value = "on"
    }
    database_flags {
      name  = "log_lock_waits"
      value = "on"
    }
    database_flags {
      name  = "log_min_messages"
      value = "error"
    }
    database_flags {
      name  = "log_temp_files"
      value = "0"
    }
    database_flags {
      name  = "log_min_duration_statement"
      value = "-1"
    }
    database_flags {
      name  = "log_hostname"
      value = "on"
    }
    database_flags {
      name  = "log_duration"
      value = "on"
    }
    database_flags {
      name  = "log_statement"
      value = "ddl"
    }
    database_flags {
      name  = "log_min_error_statement"
      value = "error"
    }
    database_flags {
      name  = "cloudsql.enable_pgaudit"
      value = "on"
    }
  }

  depends_on = [google_service_networking_connection.services]
}

resource "google_sql_database" "ledger" {
  name     = "forge"
  instance = google_sql_database_instance.ledger.name
}

resource "random_password" "ledger" {
  length  = 32
  special = false
}

resource "google_sql_user" "ledger" {
  name     = "forge"
  instance = google_sql_database_instance.ledger.name
  password = random_password.ledger.result
}
