"""The commands of `mesh`, one module per family; `irismesh.cli` builds the parser from them.

    base      one-line errors, argument types, the options and the node every joining command
              shares, and where each setting comes from (flags, context, environment, defaults)
    keys      mesh keygen, mesh keys status, mesh identity new
    grants    mesh authority new, mesh grant, mesh revoke
    serve     mesh node (echo, or a command run per request or per tunnel)
    gateway   mesh gateway (links to other meshes' gateways)
    request   mesh request
    fanout    mesh broadcast, mesh survey
    pubsub    mesh publish, mesh subscribe
    tunnel    mesh tunnel
    listing   mesh peers, mesh clusters (and the views `top` reuses)
    top       mesh top
    bench     mesh bench
    telemetry mesh telemetry report (Spark, imported only when it runs)
    context   mesh context add|ls|use|rm (the config file itself: config)
    completion mesh completion bash|zsh

Each module has `register(commands)`, which adds its subparsers and sets `run`, a function of
the parsed arguments returning the exit status (async when it joins the mesh). A new family is
a new module here and one line in `irismesh.cli`.
"""
