"""The ZMQ data plane: the message server the engine-side connector talks to."""
