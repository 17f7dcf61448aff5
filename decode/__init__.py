"""The decode worker (`pdserve decode`)."""
