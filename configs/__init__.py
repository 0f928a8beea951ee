"""ml_collections configs (big_vision style): `get_config(arg) -> locked ConfigDict`."""
