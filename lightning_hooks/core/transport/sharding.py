"""The sharded-parameter statistics, re-exported from :mod:`.distributed` (their module)."""

from lightning_hooks.core.transport.distributed import (
    ShardPlan,
    combine_partials,
    is_sharded,
    to_local,
)

__all__ = ["ShardPlan", "combine_partials", "is_sharded", "to_local"]
