"""The server's routes, one router per job; ``create_app`` includes them."""
