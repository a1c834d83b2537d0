# Ray's GCS fault tolerance (KubeRay's gcsFaultToleranceOptions, the chart's gcsFaultTolerance):
# the head's GCS keeps its tables (actors, placement groups, nodes, Serve's checkpoints) in this
# Redis, so after the head pod is evicted or crashes the new head reloads them and the workers
# keep serving meanwhile (gateways, vLLM replicas); without it a lost head restarts the whole
# Ray cluster (issue 32, item 15).
#
# Its own instance, apart from the budgets' and the cache's (redis.tf): the GCS writes on every
# actor and node change, none of its keys may ever be evicted, and a Forge-side FLUSH, a full
# budgets' instance or the cache's eviction must never reach the Ray cluster's state. The GCS
# stops when it cannot reach Redis, so STANDARD_HA (a failover instead of a maintenance restart)
# and RDB snapshots; KubeRay deletes the cluster's keys (a cleanup Job) when a RayCluster goes,
# so a NewCluster upgrade leaves nothing behind.
locals {
  # rediss://: TLS to the instance; the head verifies it with RAY_REDIS_CA_CERT (the chart mounts
  # the CA from the forge-ray-gcs-redis Secret). The AUTH string goes in its own secret, which
  # KubeRay passes as REDIS_PASSWORD.
  ray_gcs_redis_address = format(
    "rediss://%s:%d",
    google_redis_instance.ray_gcs.host,
    google_redis_instance.ray_gcs.port,
  )
}

resource "google_redis_instance" "ray_gcs" {
  name           = "${var.cluster_name}-ray-gcs"
  region         = var.region
  location_id    = var.zone
  tier           = "STANDARD_HA"
  memory_size_gb = var.ray_gcs_redis_memory_size_gb
  redis_version  = "REDIS_7_2"
  labels         = local.labels

  authorized_network = google_compute_network.forge.id
  connect_mode       = "PRIVATE_SERVICE_ACCESS"

  auth_enabled            = true
  transit_encryption_mode = "SERVER_AUTHENTICATION"

  redis_configs = {
    maxmemory-policy = "noeviction"
  }

  persistence_config {
    persistence_mode    = "RDB"
    rdb_snapshot_period = "ONE_HOUR"
  }

  # An hour after the budgets' (redis.tf), so no two instances are patched at once.
  maintenance_policy {
    weekly_maintenance_window {
      day = "SUNDAY"
      start_time {
        hours   = 5
        minutes = 0
        seconds = 0
        nanos   = 0
      }
    }
  }

  depends_on = [google_service_networking_connection.services]
}

resource "google_secret_manager_secret_version" "ray_gcs_redis_address" {
  secret      = google_secret_manager_secret.forge["ray-gcs-redis-address"].id
  secret_data = local.ray_gcs_redis_address
}

resource "google_secret_manager_secret_version" "ray_gcs_redis_password" {
  secret      = google_secret_manager_secret.forge["ray-gcs-redis-password"].id
  secret_data = google_redis_instance.ray_gcs.auth_string
}

resource "google_secret_manager_secret_version" "ray_gcs_redis_ca" {
  secret      = google_secret_manager_secret.forge["ray-gcs-redis-ca"].id
  secret_data = google_redis_instance.ray_gcs.server_ca_certs[0].cert
}
