"""The Kubernetes boundary: the objects we read and write (``objects``), the narrow API we need
(``api.KubeApi``), its one implementation on kubernetes_asyncio (``client``) and leader election
on a coordination.k8s.io Lease (``leader``). Nothing else in gpuwarden imports kubernetes_asyncio.
"""
