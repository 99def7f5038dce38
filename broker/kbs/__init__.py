"""The KBS protocol (Trustee's, version 0.4.0) that Confidential Containers guests speak."""
