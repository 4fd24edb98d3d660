"""The SSD draft process: our own small torch runner for the draft model, the speculation tree, the
speculation cache and the ZeroMQ server.  Nothing in this subpackage imports SGLang."""
