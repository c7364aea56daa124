"""How routed tokens move between expert-parallel ranks: one dispatcher class per transport."""
