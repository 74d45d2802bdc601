"""What runs only inside Ray's runtime-env agent: the plugin (Ray's glue, over `env` and
`build`), the Ray internals it uses (`ray_compat`), the checks of Ray's library extras, and the
setup errors as the driver reads them."""
