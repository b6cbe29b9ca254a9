"""optim-factory inside other training frameworks (docs/drop-in.md): ``optim_factory.integrations.torchtitan``
(torchtitan 0.3's optimizer container). Each module imports its framework; ``import optim_factory`` imports none."""
