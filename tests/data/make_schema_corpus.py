"""Writes tests/data/schema_corpus.json: 56 JSON schemas in the shapes real services use (Kubernetes objects,
package manifests, API payloads, function-call parameters), written for this project. Run it after editing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

S: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer"}
N: dict[str, Any] = {"type": "number"}
B: dict[str, Any] = {"type": "boolean"}


def obj(
    props: dict[str, Any], required: list[str] | None = None, extra: bool | None = None, **kw: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if extra is not None:
        out["additionalProperties"] = extra
    out.update(kw)
    return out


def arr(items: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **kw}


def enum(*values: Any) -> dict[str, Any]:
    return {"enum": list(values)}


def s(**kw: Any) -> dict[str, Any]:
    return {"type": "string", **kw}


def i(**kw: Any) -> dict[str, Any]:
    return {"type": "integer", **kw}


def fn(description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """OpenAI-style function-call parameters."""
    return obj(props, required, False, description=description)


labels = {"type": "object", "additionalProperties": S}
meta = obj({"name": s(maxLength=63), "namespace": S, "labels": labels, "annotations": labels}, ["name"])
container = obj(
    {
        "name": S,
        "image": S,
        "command": arr(S),
        "args": arr(S),
        "ports": arr(
            obj(
                {"containerPort": i(minimum=1, maximum=65535), "protocol": enum("TCP", "UDP", "SCTP")},
                ["containerPort"],
            )
        ),
        "env": arr(obj({"name": S, "value": S}, ["name"])),
        "resources": obj({"limits": labels, "requests": labels}),
    },
    ["name", "image"],
)
pod_spec = obj(
    {
        "containers": arr(container, minItems=1),
        "restartPolicy": enum("Always", "OnFailure", "Never"),
        "nodeSelector": labels,
    },
    ["containers"],
)
selector = obj({"matchLabels": labels})
address = obj(
    {"street": S, "city": S, "postalCode": S, "country": s(minLength=2, maxLength=2)}, ["street", "city", "country"]
)
money = obj({"amount": N, "currency": s(pattern="^[A-Z]{3}$")}, ["amount", "currency"])
person = obj({"firstName": S, "lastName": S, "email": s(format="email"), "phone": S}, ["firstName", "lastName"])

CORPUS: dict[str, Any] = {
    "k8s_pod": obj(
        {"apiVersion": {"const": "v1"}, "kind": {"const": "Pod"}, "metadata": meta, "spec": pod_spec},
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    "k8s_deployment": obj(
        {
            "apiVersion": {"const": "apps/v1"},
            "kind": {"const": "Deployment"},
            "metadata": meta,
            "spec": obj(
                {"replicas": i(minimum=0), "selector": selector, "template": obj({"metadata": meta, "spec": pod_spec})},
                ["selector", "template"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    "k8s_service": obj(
        {
            "apiVersion": {"const": "v1"},
            "kind": {"const": "Service"},
            "metadata": meta,
            "spec": obj(
                {
                    "type": enum("ClusterIP", "NodePort", "LoadBalancer"),
                    "selector": labels,
                    "ports": arr(
                        obj(
                            {"port": i(minimum=1, maximum=65535), "targetPort": {"anyOf": [INT, S]}, "name": S},
                            ["port"],
                        )
                    ),
                }
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    "k8s_configmap": obj(
        {"apiVersion": {"const": "v1"}, "kind": {"const": "ConfigMap"}, "metadata": meta, "data": labels},
        ["apiVersion", "kind", "metadata"],
    ),
    "k8s_secret": obj(
        {"apiVersion": {"const": "v1"}, "kind": {"const": "Secret"}, "metadata": meta, "type": S, "stringData": labels},
        ["apiVersion", "kind", "metadata"],
    ),
    "k8s_ingress": obj(
        {
            "apiVersion": {"const": "networking.k8s.io/v1"},
            "kind": {"const": "Ingress"},
            "metadata": meta,
            "spec": obj(
                {
                    "rules": arr(
                        obj(
                            {
                                "host": S,
                                "http": obj(
                                    {
                                        "paths": arr(
                                            obj(
                                                {
                                                    "path": S,
                                                    "pathType": enum("Prefix", "Exact", "ImplementationSpecific"),
                                                    "backend": obj(
                                                        {"service": obj({"name": S, "port": obj({"number": INT})})}
                                                    ),
                                                },
                                                ["path", "pathType", "backend"],
                                            )
                                        )
                                    }
                                ),
                            }
                        )
                    )
                }
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    "k8s_cronjob": obj(
        {
            "apiVersion": {"const": "batch/v1"},
            "kind": {"const": "CronJob"},
            "metadata": meta,
            "spec": obj(
                {
                    "schedule": S,
                    "concurrencyPolicy": enum("Allow", "Forbid", "Replace"),
                    "jobTemplate": obj({"spec": obj({"template": obj({"spec": pod_spec})})}),
                },
                ["schedule", "jobTemplate"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    "k8s_hpa": obj(
        {
            "apiVersion": {"const": "autoscaling/v2"},
            "kind": {"const": "HorizontalPodAutoscaler"},
            "metadata": meta,
            "spec": obj(
                {
                    "scaleTargetRef": obj({"apiVersion": S, "kind": S, "name": S}, ["kind", "name"]),
                    "minReplicas": i(minimum=1),
                    "maxReplicas": i(minimum=1),
                },
                ["scaleTargetRef", "maxReplicas"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    "k8s_pvc": obj(
        {
            "apiVersion": {"const": "v1"},
            "kind": {"const": "PersistentVolumeClaim"},
            "metadata": meta,
            "spec": obj(
                {
                    "accessModes": arr(enum("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany")),
                    "resources": obj({"requests": obj({"storage": S}, ["storage"])}),
                    "storageClassName": S,
                }
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    "k8s_namespace": obj(
        {"apiVersion": {"const": "v1"}, "kind": {"const": "Namespace"}, "metadata": meta},
        ["apiVersion", "kind", "metadata"],
    ),
    "package_json": obj(
        {
            "name": s(maxLength=214),
            "version": S,
            "description": S,
            "main": S,
            "scripts": labels,
            "dependencies": labels,
            "devDependencies": labels,
            "license": S,
            "private": B,
            "keywords": arr(S),
            "author": {"anyOf": [S, obj({"name": S, "email": S})]},
        },
        ["name", "version"],
    ),
    "pyproject_project": obj(
        {
            "name": S,
            "version": S,
            "description": S,
            "requires-python": S,
            "dependencies": arr(S),
            "optional-dependencies": {"type": "object", "additionalProperties": arr(S)},
            "authors": arr(obj({"name": S, "email": S})),
            "license": obj({"text": S}),
        },
        ["name"],
    ),
    "cargo_package": obj(
        {
            "package": obj(
                {"name": S, "version": S, "edition": enum("2015", "2018", "2021", "2024"), "authors": arr(S)},
                ["name", "version"],
            ),
            "dependencies": {
                "type": "object",
                "additionalProperties": {"anyOf": [S, obj({"version": S, "features": arr(S)})]},
            },
        },
        ["package"],
    ),
    "composer_json": obj(
        {
            "name": s(pattern="^[a-z0-9_.-]+/[a-z0-9_.-]+$"),
            "type": enum("library", "project", "metapackage", "composer-plugin"),
            "require": labels,
            "autoload": obj({"psr-4": labels}),
        },
        ["name"],
    ),
    "docker_compose_service": obj(
        {
            "image": S,
            "build": {"anyOf": [S, obj({"context": S, "dockerfile": S})]},
            "ports": arr(S),
            "environment": labels,
            "volumes": arr(S),
            "depends_on": arr(S),
            "restart": enum("no", "always", "on-failure", "unless-stopped"),
        }
    ),
    "github_workflow_job": obj(
        {
            "runs-on": S,
            "needs": arr(S),
            "steps": arr(obj({"name": S, "uses": S, "run": S, "with": labels}), minItems=1),
            "timeout-minutes": i(minimum=1),
        },
        ["runs-on", "steps"],
    ),
    "openapi_info": obj(
        {
            "title": S,
            "version": S,
            "description": S,
            "contact": obj({"name": S, "url": S, "email": S}),
            "license": obj({"name": S, "url": S}, ["name"]),
        },
        ["title", "version"],
    ),
    "geojson_point": obj(
        {"type": {"const": "Point"}, "coordinates": arr(N, minItems=2, maxItems=3)}, ["type", "coordinates"]
    ),
    "geojson_feature": obj(
        {
            "type": {"const": "Feature"},
            "geometry": obj(
                {"type": enum("Point", "LineString", "Polygon"), "coordinates": arr({})}, ["type", "coordinates"]
            ),
            "properties": {"type": ["object", "null"]},
        },
        ["type", "geometry", "properties"],
    ),
    "user_profile": obj(
        {
            "id": S,
            "username": s(minLength=3, maxLength=30),
            "email": s(format="email"),
            "createdAt": s(format="date-time"),
            "roles": arr(enum("admin", "user", "guest")),
            "address": address,
        },
        ["id", "username", "email"],
    ),
    "order": obj(
        {
            "orderId": S,
            "customer": person,
            "items": arr(
                obj({"sku": S, "quantity": i(minimum=1), "price": money}, ["sku", "quantity", "price"]), minItems=1
            ),
            "total": money,
            "status": enum("pending", "paid", "shipped", "delivered", "cancelled"),
        },
        ["orderId", "items", "total", "status"],
    ),
    "invoice": obj(
        {
            "number": S,
            "issued": s(format="date"),
            "due": s(format="date"),
            "seller": person,
            "buyer": person,
            "lines": arr(obj({"description": S, "amount": money}, ["description", "amount"])),
            "paid": B,
        },
        ["number", "issued", "lines"],
    ),
    "payment_intent": obj(
        {
            "amount": i(minimum=1),
            "currency": s(minLength=3, maxLength=3),
            "payment_method_types": arr(enum("card", "sepa_debit", "ideal")),
            "capture_method": enum("automatic", "manual"),
            "metadata": labels,
        },
        ["amount", "currency"],
    ),
    "webhook_event": obj(
        {"id": S, "type": S, "created": INT, "data": obj({"object": {"type": "object"}}, ["object"]), "livemode": B},
        ["id", "type", "created", "data"],
    ),
    "slack_message": obj(
        {
            "channel": S,
            "text": S,
            "blocks": arr(
                obj(
                    {
                        "type": enum("section", "divider", "header"),
                        "text": obj({"type": enum("mrkdwn", "plain_text"), "text": S}, ["type", "text"]),
                    },
                    ["type"],
                )
            ),
            "thread_ts": S,
        },
        ["channel"],
    ),
    "github_issue": obj(
        {"title": S, "body": S, "labels": arr(S), "assignees": arr(S), "milestone": {"type": ["integer", "null"]}},
        ["title"],
    ),
    "github_pr": obj(
        {"title": S, "head": S, "base": S, "body": S, "draft": B, "maintainer_can_modify": B}, ["title", "head", "base"]
    ),
    "jira_issue": obj(
        {
            "fields": obj(
                {
                    "project": obj({"key": S}, ["key"]),
                    "summary": S,
                    "issuetype": obj({"name": enum("Bug", "Task", "Story", "Epic")}, ["name"]),
                    "priority": obj({"name": enum("Highest", "High", "Medium", "Low", "Lowest")}),
                    "labels": arr(S),
                },
                ["project", "summary", "issuetype"],
            )
        },
        ["fields"],
    ),
    "calendar_event": obj(
        {
            "summary": S,
            "location": S,
            "start": obj({"dateTime": s(format="date-time"), "timeZone": S}, ["dateTime"]),
            "end": obj({"dateTime": s(format="date-time"), "timeZone": S}, ["dateTime"]),
            "attendees": arr(obj({"email": s(format="email"), "optional": B}, ["email"])),
        },
        ["summary", "start", "end"],
    ),
    "product": obj(
        {
            "productId": INT,
            "productName": S,
            "price": {"type": "number", "exclusiveMinimum": 0},
            "tags": arr(S, minItems=1),
            "dimensions": obj({"length": N, "width": N, "height": N}, ["length", "width", "height"]),
        },
        ["productId", "productName", "price"],
    ),
    "review": obj(
        {
            "rating": i(minimum=1, maximum=5),
            "title": s(maxLength=100),
            "body": S,
            "recommend": B,
            "pros": arr(S),
            "cons": arr(S),
        },
        ["rating", "body"],
    ),
    "log_record": obj(
        {
            "timestamp": s(format="date-time"),
            "level": enum("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
            "logger": S,
            "message": S,
            "context": {"type": "object"},
        },
        ["timestamp", "level", "message"],
    ),
    "metric_point": obj({"name": S, "value": N, "unit": S, "tags": labels, "timestamp": INT}, ["name", "value"]),
    "oauth_token": obj(
        {"access_token": S, "token_type": enum("Bearer"), "expires_in": i(minimum=0), "refresh_token": S, "scope": S},
        ["access_token", "token_type"],
    ),
    "jwt_claims": obj(
        {"iss": S, "sub": S, "aud": {"anyOf": [S, arr(S)]}, "exp": INT, "iat": INT, "nbf": INT, "jti": S},
        ["iss", "sub", "exp"],
    ),
    "error_problem_json": obj(
        {"type": S, "title": S, "status": i(minimum=100, maximum=599), "detail": S, "instance": S}, ["title", "status"]
    ),
    "pagination_response": obj(
        {
            "data": arr({"type": "object"}),
            "page": i(minimum=1),
            "per_page": i(minimum=1, maximum=100),
            "total": i(minimum=0),
            "next": {"type": ["string", "null"]},
        },
        ["data", "page", "total"],
    ),
    "recipe": obj(
        {
            "name": S,
            "servings": i(minimum=1),
            "prepTimeMinutes": i(minimum=0),
            "ingredients": arr(
                obj(
                    {"item": S, "quantity": N, "unit": enum("g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece")},
                    ["item"],
                ),
                minItems=1,
            ),
            "steps": arr(S, minItems=1),
        },
        ["name", "ingredients", "steps"],
    ),
    "resume": obj(
        {
            "basics": obj(
                {"name": S, "label": S, "email": s(format="email"), "location": obj({"city": S, "countryCode": S})},
                ["name"],
            ),
            "work": arr(
                obj(
                    {
                        "name": S,
                        "position": S,
                        "startDate": s(format="date"),
                        "endDate": s(format="date"),
                        "highlights": arr(S),
                    },
                    ["name", "position"],
                )
            ),
            "skills": arr(obj({"name": S, "level": enum("Beginner", "Intermediate", "Advanced", "Master")})),
        },
        ["basics"],
    ),
    "fn_get_weather": fn(
        "Get the current weather",
        {"location": s(description="City and country, e.g. Paris, France"), "unit": enum("celsius", "fahrenheit")},
        ["location"],
    ),
    "fn_search_web": fn(
        "Search the web", {"query": S, "num_results": i(minimum=1, maximum=20), "safe_search": B}, ["query"]
    ),
    "fn_send_email": fn(
        "Send an email",
        {"to": arr(s(format="email"), minItems=1), "subject": S, "body": S, "cc": arr(s(format="email"))},
        ["to", "subject", "body"],
    ),
    "fn_create_calendar_event": fn(
        "Create an event",
        {
            "title": S,
            "start": s(format="date-time"),
            "duration_minutes": i(minimum=5, maximum=1440),
            "attendees": arr(S),
        },
        ["title", "start"],
    ),
    "fn_book_flight": fn(
        "Book a flight",
        {
            "origin": s(pattern="^[A-Z]{3}$"),
            "destination": s(pattern="^[A-Z]{3}$"),
            "date": s(format="date"),
            "passengers": i(minimum=1, maximum=9),
            "cabin": enum("economy", "premium", "business", "first"),
        },
        ["origin", "destination", "date"],
    ),
    "fn_sql_query": fn(
        "Run a read-only SQL query",
        {"sql": S, "database": enum("analytics", "billing", "users"), "limit": i(minimum=1, maximum=1000)},
        ["sql", "database"],
    ),
    "fn_translate": fn(
        "Translate text",
        {"text": S, "source_language": s(minLength=2, maxLength=5), "target_language": s(minLength=2, maxLength=5)},
        ["text", "target_language"],
    ),
    "fn_get_stock_price": fn(
        "Get a stock quote",
        {"ticker": s(pattern="^[A-Z]{1,5}$"), "exchange": enum("NASDAQ", "NYSE", "LSE")},
        ["ticker"],
    ),
    "fn_set_thermostat": fn(
        "Set the thermostat",
        {
            "room": S,
            "temperature": {"type": "number", "minimum": 5, "maximum": 35},
            "mode": enum("heat", "cool", "auto", "off"),
        },
        ["room", "temperature"],
    ),
    "fn_create_ticket": fn(
        "Open a support ticket",
        {
            "title": S,
            "severity": enum("low", "medium", "high", "critical"),
            "component": S,
            "steps_to_reproduce": arr(S),
        },
        ["title", "severity"],
    ),
    "fn_extract_entities": fn(
        "Extract entities",
        {"people": arr(S), "organizations": arr(S), "locations": arr(S), "dates": arr(s(format="date"))},
        ["people", "organizations", "locations"],
    ),
    "fn_classify_sentiment": fn(
        "Classify sentiment",
        {
            "label": enum("positive", "negative", "neutral"),
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        ["label", "confidence"],
    ),
    "fn_unit_convert": fn(
        "Convert units", {"value": N, "from_unit": S, "to_unit": S}, ["value", "from_unit", "to_unit"]
    ),
    "tree_recursive": {
        "$defs": {"node": obj({"name": S, "children": arr({"$ref": "#/$defs/node"})}, ["name"])},
        "$ref": "#/$defs/node",
    },
    "json_patch": arr(
        obj(
            {"op": enum("add", "remove", "replace", "move", "copy", "test"), "path": S, "value": {}, "from": S},
            ["op", "path"],
        )
    ),
    "semver_release": obj(
        {"version": s(pattern="^[0-9]+\\.[0-9]+\\.[0-9]+(-[0-9A-Za-z.-]+)?$"), "notes": S, "prerelease": B}, ["version"]
    ),
    "feature_flags": obj(
        {
            "flags": {
                "type": "object",
                "additionalProperties": obj({"enabled": B, "rollout": i(minimum=0, maximum=100)}, ["enabled"]),
            }
        },
        ["flags"],
    ),
    # Uses keywords no grammar enforces: must be refused, never served unchecked.
    "unenforceable_unique_tags": obj({"tags": arr(S, uniqueItems=True)}, ["tags"]),
    "unenforceable_if_then": {
        "type": "object",
        "properties": {"kind": S, "size": INT},
        "if": {"properties": {"kind": {"const": "box"}}},
        "then": {"required": ["size"]},
    },
}

if __name__ == "__main__":
    path = Path(__file__).with_name("schema_corpus.json")
    path.write_text(json.dumps(CORPUS, indent=1) + "\n")
    print(f"{len(CORPUS)} schemas -> {path}")
