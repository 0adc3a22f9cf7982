"""The broker: jobs on leases, the replay buffer, policy versions, durable in SQLite."""
