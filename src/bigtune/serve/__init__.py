"""bigtune for a team: a training service that admits fine-tuning jobs by their memory plan, queues them and runs
them (``bigtune serve``; docs/how-to/serve.md).

Thin edges around a plain core, one module per stage, imports pointing one way:
``api`` (HTTP: parse, authorise) → ``service`` (the jobs' life: admit, queue, start, watch, retry, cancel) →
``admission`` (recipe, allowed paths, plan), ``policy`` (the queue's order, a pure function), ``backends`` (where a
job's process runs), ``store`` (the database), ``progress`` (what a run folder says), ``auth`` (tokens).
``schemas`` holds the request and response models the API, its OpenAPI schema and the CLI client share; ``page``
serves the web page (assets/serve_page.html), which reads the same API.
"""
