"""Bus helpers: subject names, the embedded nats-server, connections, streams, workers, kvpool client."""
