"""The source's layers, bottom to top (docs/architecture.md): what tests/top/test_layers.py holds
the imports to, and what the test folders mirror. A layer is one or more folders of src/grpokit;
the modules at the top of the package (api.py, cli.py, server.py, trl_config.py) are the top layer."""

LAYERS = [("runtime", "settings"), ("algorithm",), ("models",), ("engines",), ("tasks",), ("rewards",), ("rollouts",), ("config",),
          ("sampling",), ("rundir",), ("training",)]
