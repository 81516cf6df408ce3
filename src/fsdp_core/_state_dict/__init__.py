"""State dicts of both doors: full ones gathered by ``summon_full_params`` (``full``), sharded
(``DTensor``) and local ones (``sharded``), the ``state_dict_type`` settings and the save/load
dispatch on them (``settings``), optimizer state dicts keyed by parameter name (``optim``)."""
