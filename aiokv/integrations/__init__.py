"""aiokv under other projects' KV-cache managers.

``aiokv.integrations.recsys``: NVIDIA recsys-examples' ``HostKVStorageBase`` on aiokv
(importable without recsys-examples; its storage class needs it).
"""
