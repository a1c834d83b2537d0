# Memorystore, as two instances, because Forge's hot state is of two kinds (configs/gke.yaml):
#
# - budgets (`store:`, FORGE_REDIS_URL): token buckets, stream leases, and the ids that make a
#   refund apply once. None of it may be evicted (an evicted bucket is a refilled budget, an
#   evicted id a refund applied twice), so `noeviction`: a full instance refuses writes, which
#   the gateways count and fail soft on (each tenant held to its local share), never silently.
#   STANDARD_HA, because a BASIC instance's maintenance restart or crash empties it, and an empty
#   store hands every tenant a full burst on every gateway. A failover promotes the replica in
#   another zone instead; replication is asynchronous, so a failover can lose the last second or
#   so of writes: at most one burst per tenant, the same as each gateway's fresh local share when
#   an outage starts. RDB snapshots every hour cover what a failover cannot (both nodes lost, or
#   a restart of the whole instance): restored levels up to an hour old, which refill within
#   their window anyway; the state that lives longest is a bucket without refill (a day at most).
# - the response cache (`cache.store`, FORGE_CACHE_REDIS_URL): entries the gateways can always
#   do without (a miss is a safe answer). BASIC with `allkeys-lru`: it fills to maxmemory and
#   drops its least recently used entries, and a restart costs a cold cache. Apart from the
#   budgets, it can never push a budget key out, whatever its traffic.
#
# Both are reached over private service access, with AUTH and TLS. Memorystore cannot change an
# instance's tier in place: moving an existing BASIC store to STANDARD_HA replaces it (budgets
# start full once; `terraform plan` shows the replacement).
locals {
  # redis-py reads ssl_ca_certs from the URL; each instance's CA is a secret mounted beside it.
  # The URL names the instance by IP, which its server certificate may not carry as a SAN, and
  # redis-py >= 6 checks the hostname by default: a failed check fails the store open (budgets
  # off). The chain is still verified against the instance's own CA, which signs nothing but
  # that instance's certificate, so that check is what proves the peer; the name check is off.
  redis_ca_path       = "/etc/forge/keys/redis-ca.pem"
  redis_cache_ca_path = "/etc/forge/keys/redis-cache-ca.pem"
  redis_url = format(
    "rediss://:%s@%s:%d/0?ssl_ca_certs=%s&ssl_check_hostname=false",
    urlencode(google_redis_instance.budgets.auth_string),
    google_redis_instance.budgets.host,
    google_redis_instance.budgets.port,
    local.redis_ca_path,
  )
  redis_cache_url = format(
    "rediss://:%s@%s:%d/0?ssl_ca_certs=%s&ssl_check_hostname=false",
    urlencode(google_redis_instance.cache.auth_string),
    google_redis_instance.cache.host,
    google_redis_instance.cache.port,
    local.redis_cache_ca_path,
  )
}

# The budgets' instance was the only one (`forge`) before the cache had its own.
moved {
  from = google_redis_instance.forge
  to   = google_redis_instance.budgets
}

resource "google_redis_instance" "budgets" {
  name           = "${var.cluster_name}-store"
  region         = var.region
  location_id    = var.zone
  tier           = "STANDARD_HA" # the replica in another zone is picked by Memorystore
  memory_size_gb = var.redis_memory_size_gb
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

  # Memorystore patches itself (on STANDARD_HA by a failover); keep it off the busiest hours
  # (Sunday 04:00 UTC).
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

resource "google_redis_instance" "cache" {
  name           = "${var.cluster_name}-cache"
  region         = var.region
  location_id    = var.zone
  tier           = "BASIC"
  memory_size_gb = var.redis_cache_memory_size_gb
  redis_version  = "REDIS_7_2"
  labels         = local.labels

  authorized_network = google_compute_network.forge.id
  connect_mode       = "PRIVATE_SERVICE_ACCESS"

  auth_enabled            = true
  transit_encryption_mode = "SERVER_AUTHENTICATION"

  # No persistence: a restart empties the cache, which is all a restart may cost it.
  redis_configs = {
    maxmemory-policy = "allkeys-lru"
  }

  # An hour before the budgets', so the two are never patched at once.
  maintenance_policy {
    weekly_maintenance_window {
      day = "SUNDAY"
      start_time {
        hours   = 3
        minutes = 0
        seconds = 0
        nanos   = 0
      }
    }
  }

  depends_on = [google_service_networking_connection.services]
}
