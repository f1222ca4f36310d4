"""`kvxferd bench`: each benchmark measures kvxferd against a baseline taken in the same run."""
