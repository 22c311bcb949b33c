"""Built-in consumers: ``stats``, ``export``, ``steer``. They register through the same
pluggy hook as third-party consumers (see ``consumers.plugin``)."""
