# Placed first on an actor's PYTHONPATH by the tests to make NIXL unimportable
# there, as on a host where it is not installed.
raise ImportError(
    "No module named 'nixl_cu13' (NIXL hidden from this actor by tests/_no_nixl)", name="nixl_cu13"
)
