"""Bridges from fp8ops to training frameworks, each an optional dependency imported only by its
own subpackage (fp8ops.integrations.torchtitan imports torchtitan; `import fp8ops` imports
neither)."""
