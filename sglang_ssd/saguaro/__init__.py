"""Pure math of Saguaro / SSD: no SGLang, no ZeroMQ imports in this subpackage."""
