"""memops' local cluster: the upstream control plane (:mod:`memops_sandbox.controlplane`, from
binaries that :mod:`memops_sandbox.build` makes from the Kubernetes Go modules) with the
operator installed as on a cluster (:mod:`memops_sandbox.install`), and the node agent that
runs pods as local processes. Started by ``memops sandbox``; installed with
``pip install 'memops[sandbox]'``. The operator's image carries none of it.
"""
