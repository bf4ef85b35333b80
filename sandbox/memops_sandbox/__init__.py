"""memops' local cluster: the upstream control plane (:mod:`memops_sandbox.controlplane`, from
binaries that :mod:`memops_sandbox.build` makes from the Kubernetes Go modules) with the
operator installed as on a cluster (:mod:`memops_sandbox.install`), and real Nodes (kubelets,
containerd, runc, CNI: :mod:`memops_sandbox.nodes`, from images that :mod:`memops_sandbox.images`
writes) or, as a fallback, the node agent that runs pods as local processes. Started by
``memops sandbox``; installed with ``pip install -e . -e ./sandbox`` from a checkout (it installs
the chart in ``helm/memops`` and builds the operator's image from the sources). The operator's
image carries none of it.
"""
