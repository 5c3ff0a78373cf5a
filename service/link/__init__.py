"""What front ends and engines both import: the byte stream over Unix sockets (`stream`), the message format
(`wire`), the shared-memory arena a front end writes rows into (`arena`), and the plan file (`plan`)."""
