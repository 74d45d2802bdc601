"""Building a venv on a node: reused if ready or built once under its key's lock (`ensure`),
the steps of one build (`steps`), what it records of itself (`record`), bytecode seeded from
the nearest ready venv (`seeding`) or compiled (`bytecode`), its phases as they happen, and
builds that just failed."""
