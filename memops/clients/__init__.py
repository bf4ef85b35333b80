"""The operator's clients: the Kubernetes API (:mod:`kube`), a Dask scheduler over the comm
(:mod:`daskrpc`), and the comm protocol itself (:mod:`daskcomm`, which the preStop hook carries
as source). The controllers call them; the deciding code below them never does."""
