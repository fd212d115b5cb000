"""Off the device and across ranks: the host mailbox, collectives, sharded parameters."""
