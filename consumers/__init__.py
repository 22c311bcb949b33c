"""Built-in consumers: ``stats``, ``export``, ``steer``, ``sae``. They register through the same
pluggy hook as third-party consumers (see ``consumers.plugin``)."""
