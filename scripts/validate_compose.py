#!/usr/bin/env python3
"""Validates a Compose file against the Compose Specification's JSON schema.

    scripts/validate_compose.py [COMPOSE_FILE] [SCHEMA]

Defaults: docker-compose.yml and deploy/schema/compose-spec.json (vendored, see
deploy/schema/README.md). Needs PyYAML and jsonschema (scripts/test installs both into its
virtual environment). Besides the schema it checks what the schema cannot: every file a
service mounts from the checkout exists. Exits 1 with one line per problem.
"""

import os
import sys

import jsonschema
import yaml


def problems(compose_path, schema_path):
    with open(compose_path, encoding="utf-8") as f:
        document = yaml.safe_load(f)  # SafeLoader resolves `<<:` merge keys
    with open(schema_path, encoding="utf-8") as f:
        schema = yaml.safe_load(f)
    validator = jsonschema.Draft7Validator(schema)
    for error in sorted(validator.iter_errors(document), key=lambda e: list(e.path)):
        where = "/".join(str(p) for p in error.path) or "(top level)"
        yield f"{compose_path}: {where}: {error.message}"
    base = os.path.dirname(os.path.abspath(compose_path))
    for name, service in (document.get("services") or {}).items():
        for volume in service.get("volumes") or []:
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("./") and not os.path.exists(os.path.join(base, source)):
                yield f"{compose_path}: services/{name}/volumes: {source} does not exist"


def main(argv):
    compose = argv[1] if len(argv) > 1 else "docker-compose.yml"
    schema = argv[2] if len(argv) > 2 else "deploy/schema/compose-spec.json"
    found = list(problems(compose, schema))
    for line in found:
        print(line, file=sys.stderr)
    if found:
        return 1
    print(f"{compose}: valid against the Compose Specification schema")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
