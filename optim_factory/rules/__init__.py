"""The rules of FusedAdam's options and of its config, written once, one module per kind, each refusal one
:class:`~optim_factory.errors.ConfigError` carrying the key, the value and what is allowed:

* :mod:`.adam`: the constructor's Adam options (dtype spellings, hyperparameters, flags, state dtypes);
* :mod:`.groups`: a parameter group's (its keys and values by :mod:`.adam`'s rules, its parameters' dtypes);
* :mod:`.export`: the export options' (sizes, pinning, what each option needs of the others);
* :mod:`.host`: what a rank may take of its host (the ranks sharing it, the host budget ``"auto"``);
* :mod:`.config`: those an optimizer config adds (``lr > 0``, the ``param_groups`` patterns and multipliers, no
  AMSGrad in FusedAdam, each override pattern matching parameters of its own).

The constructors, ``ExportOptions`` and a loaded state dict's groups apply the first three; the factory's
``validate_optim_config`` applies those that need no model and ``build_param_groups`` the overrides', and
``optim_factory.errors.optim_keys`` shows a refusal there as a config key's (``optim.<key>=<value>: <allowed>``).
See docs/design.md, "Constructor rules".
"""
