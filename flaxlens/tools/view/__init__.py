"""What people look at: the text summary of a tree and its HTML view."""
