"""Plugin hooks: the hookspecs, the contribution records, the plugin manager and the registry."""
