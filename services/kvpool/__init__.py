"""kvpool: leases over a shared-memory CPU tier, with a byte path over the bus (minimal, issue 3)."""
