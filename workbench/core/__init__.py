"""What everything else stands on, none of which knows the cache: the execution backend (``backend``), a model's KV
shape and storage dtype and the bytes that follow (``kv_spec``), the storage formats (``kv_formats``), the layouts
of a K or V tensor and their address arithmetic (``layout``), the policy registries' shared pattern
(``policy_registry``) and the command lines' argument types (``argtypes``).

Nothing is imported here: ``import workbench.core.layout`` loads that module alone.
"""
