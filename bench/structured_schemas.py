"""Real-world JSON schemas the structured-output benchmark and tests compile:
the shapes of a Pydantic model, an OpenAI function's parameters, a nested
document with $defs and anyOf, and a wide record. Not a benchmark itself."""

from __future__ import annotations

from typing import Any

PERSON: dict[str, Any] = {
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

WEATHER_TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}

INVOICE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "vat_id": {"type": ["string", "null"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "postcode": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
                    },
                    "required": ["street", "city"],
                },
            },
            "required": ["name", "address"],
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit_price": {"type": "number", "minimum": 0, "maximum": 100000},
                },
                "required": ["sku", "quantity", "unit_price"],
            },
        },
        "paid": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 200},
    },
    "required": ["invoice_id", "currency", "customer", "lines", "paid"],
}

GITHUB_ISSUE: dict[str, Any] = {
    "$defs": {
        "user": {
            "type": "object",
            "properties": {
                "login": {"type": "string", "pattern": "^[a-zA-Z0-9-]{1,39}$"},
                "id": {"type": "integer", "minimum": 1},
                "site_admin": {"type": "boolean"},
            },
            "required": ["login", "id"],
        },
        "label": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "color": {"type": "string", "pattern": "^[0-9a-f]{6}$"},
                "default": {"type": "boolean"},
            },
            "required": ["name", "color"],
        },
    },
    "type": "object",
    "properties": {
        "number": {"type": "integer", "minimum": 1},
        "title": {"type": "string", "maxLength": 256},
        "state": {"enum": ["open", "closed"]},
        "state_reason": {"anyOf": [{"enum": ["completed", "not_planned", "reopened"]}, {"type": "null"}]},
        "user": {"$ref": "#/$defs/user"},
        "assignees": {"type": "array", "items": {"$ref": "#/$defs/user"}, "maxItems": 10},
        "labels": {"type": "array", "items": {"$ref": "#/$defs/label"}},
        "milestone": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"title": {"type": "string"}, "due_on": {"type": "string", "format": "date-time"}},
                    "required": ["title"],
                },
                {"type": "null"},
            ]
        },
        "comments": {"type": "integer", "minimum": 0},
        "body": {"type": ["string", "null"]},
    },
    "required": ["number", "title", "state", "user", "labels"],
}

WIDE_RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{f"text_{i}": {"type": "string", "maxLength": 64} for i in range(20)},
        **{f"count_{i}": {"type": "integer", "minimum": -1000, "maximum": 1000} for i in range(15)},
        **{f"ratio_{i}": {"type": "number", "minimum": 0, "maximum": 1} for i in range(10)},
        **{f"kind_{i}": {"enum": ["alpha", "beta", "gamma", "delta", "epsilon"]} for i in range(5)},
    },
    "required": [f"text_{i}" for i in range(0, 20, 2)] + [f"count_{i}" for i in range(15)],
}

REAL_SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "weather_tool": WEATHER_TOOL,
    "invoice": INVOICE,
    "github_issue": GITHUB_ISSUE,
    "wide_record_50": WIDE_RECORD,
}
