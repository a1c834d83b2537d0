# Memorystore for the shared store (budgets, leases, cache, metering): reached over private
# service access, with AUTH and TLS. Forge's store fails open, so the BASIC tier's lack of a
# replica costs metering and cache during an outage, never serving.
locals {
  # redis-py reads ssl_ca_certs from the URL; the CA is the redis-ca secret mounted beside it.
  redis_ca_path = "/etc/forge/keys/redis-ca.pem"
  redis_url = format(
    "rediss://:%s@%s:%d/0?ssl_ca_certs=%s",
    urlencode(google_redis_instance.forge.auth_string),
    google_redis_instance.forge.host,
    google_redis_instance.forge.port,
    local.redis_ca_path,
  )
}

resource "google_redis_instance" "forge" {
  name           = "${var.cluster_name}-store"
  region         = var.region
  location_id    = var.zone
  tier           = var.redis_tier
  memory_size_gb = var.redis_memory_size_gb
  redis_version  = "REDIS_7_2"
  labels         = local.labels

  authorized_network = google_compute_network.forge.id
  connect_mode       = "PRIVATE_SERVICE_ACCESS"

  auth_enabled            = true
  transit_encryption_mode = "SERVER_AUTHENTICATION"

  redis_configs = {
    maxmemory-policy = var.redis_maxmemory_policy
  }

  # Memorystore patches itself; keep it off the busiest hours (Sunday 04:00 UTC).
  maintenance_policy {
    weekly_maintenance_window {
      day = "SUNDAY"
      start_time {
        hours   = 4
        minutes = 0
        seconds = 0
        nanos   = 0
      }
    }
  }

  depends_on = [google_service_networking_connection.services]
}
